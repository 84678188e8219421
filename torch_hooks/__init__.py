"""In-process companion for PyTorch training jobs.

Nothing lives here yet: issue 5 builds the daemon client and guard. Issue 2's demo job
(linkpass.demo_train) needs no hook: host-IP routes keep its gloo TCP traffic flowing.
"""
