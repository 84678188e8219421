"""Host fabric discovery (GPUs, HCAs, netdevs, rails).

Nothing lives here yet: issue 3 builds it. The daemon currently takes rails and peers from
its config file (see linkpass.config).
"""
