"""The NCCL / PyTorch / CUDA / RDMA-as-NCCL-prints-it families (linkpass.core.evidence.nccl and
.rdma), read from lines written here from the producers' own format strings:

- NCCL ``src/transport/net_ib.cc`` / ``net_ib/p2p.cc`` / ``net_ib/common.cc``,
  ``src/misc/ibvwrap.cc``, ``src/misc/socket.cc`` / ``src/os/linux.cc``, ``src/include/checks.h``,
  ``src/include/cudawrap.h``, ``src/init.cc`` (``ncclGetErrorString``);
- rdma-core ``libibverbs/verbs.h`` / ``enum_strs.c`` (status and event numbers and texts);
- PyTorch ``ProcessGroupNCCL.cpp`` / ``NCCLUtils.cpp`` / c10 CUDA checks;
- CUDA 13.0 ``driver_types.h`` / ``cudaGetErrorString``.

Values (hosts, pids, bus ids, HCAs, numbers) are varied on purpose; none is a corpus line.
"""

from __future__ import annotations

import pytest

from linkpass.core.classify import classify, classify_report, classify_text
from linkpass.core.evidence.nccl import CUDA_READINGS
from linkpass.core.evidence.rdma import ASYNC_EVENTS, WC_STATUS

# rdma-core enum ibv_wc_status, in order (verbs.h), independent of the module's table
WC_NAMES = ["SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
            "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR",
            "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR",
            "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR", "TM_ERR",
            "TM_RNDV_INCOMPLETE"]
# rdma-core enum ibv_event_type, in order, with ibv_event_type_str's text as it prints it
EVENT_TEXTS = ["CQ error", "local work queue catastrophic error", "invalid request local work queue error",
               "local access violation work queue error", "communication established", "send queue drained",
               "path migrated", "path migration request error", "local catastrophic error", "port active",
               "port error", "LID change", "P_Key change", "SM change", "SRQ catastrophic error",
               "SRQ limit reached", "last WQE reached", "client reregistration", "GID table change", "WQ fatal",
               "Device link speed change"]
FATAL_EVENTS = {0: "CQ", 1: "QP", 2: "QP", 3: "QP", 8: None, 14: "SRQ"}  # ncclIbAsyncThreadMain's cases


def warn(host: str, pid: int, tid: int, dev: int, where: str, msg: str, level: str = "WARN") -> str:
    """NCCL's ncclDebugLog prefix: ``host:pid:tid [cudaDev] file:line NCCL WARN msg``."""
    return f"{host}:{pid}:{tid} [{dev}] {where} NCCL {level} {msg}\n"


def one(lines: list[str]):
    incs = classify(lines)
    roots = [i for i in incs if i.secondary_of is None]
    assert len(roots) == 1, [i.to_json() for i in incs]
    return roots[0], incs


def reading(i) -> tuple:
    return (i.domain, i.action, i.remedy)


# -- work completions -------------------------------------------------------------------------

def wc_line(fmt: str, st: int, n: int) -> str:
    hca, peer = f"mlx5_{n % 8}", f"10.{n}.3.{20 + n}<{40000 + n}>"
    if fmt == "2.7":
        body = f"NET/IB : Got completion with error {st}, opcode {n % 3}, len 0, vendor err {100 + n}"
    elif fmt == "2.14":
        body = f"NET/IB : Got completion from peer {peer} with error {st}, opcode {n % 3}, len {n}, vendor err {129}"
    elif fmt == "2.19":
        body = (f"NET/IB : Got completion from peer {peer} with error {st}, opcode 0, len 0, vendor err 249 (Recv)"
                f" localGid ::ffff:10.{n}.3.1 remoteGid ::ffff:10.{n}.3.2")
    elif fmt == "2.21":
        body = (f"NET/IB : Got completion from peer {peer} with status={st} opcode=1 len=0 vendor err 81 (Send)"
                f" localGid fe80::a{n} remoteGids fe80::b{n}")
    elif fmt == "2.27":
        body = f"NET/IB: Got completion from peer {peer} with status={st} opcode=0 len=4096 vendor err 138 (Send) hca {hca}"
    else:  # master p2p.cc: status=%s(%d) opcode=%s(%d) vendor_err=%u ... hca %s
        name = f"IBV_WC_{WC_NAMES[st]}" if st < len(WC_NAMES) else "UNKNOWN_STATUS"
        body = (f"NET/IB: Got completion from peer {peer} with status={name}({st}) opcode=IBV_WC_RDMA_WRITE(1)"
                f" vendor_err={n + 3}  localGid ::ffff:10.0.0.{n} remoteGids ::ffff:10.0.1.{n} hca {hca}")
    return warn(f"gpu-node-{n:02d}", 3000 + n, 3100 + n, n % 8, "transport/net_ib.cc:1450", body)


@pytest.mark.parametrize("fmt", ["2.7", "2.14", "2.19", "2.21", "2.27", "master"])
@pytest.mark.parametrize("st", range(len(WC_NAMES)))
def test_every_wc_status_in_every_nccl_format(fmt, st):
    n = (st * 7 + len(fmt)) % 16
    root, incs = one([wc_line(fmt, st, n)])
    assert root.code == f"ibv_wc:{st}" and root.known
    assert WC_STATUS[st][0] == WC_NAMES[st]
    assert reading(root) == WC_STATUS[st][1:]
    assert root.device == (f"mlx5_{n % 8}" if fmt in ("2.27", "master") else None)


def test_wc_readings_follow_the_source_hints():
    # printIbWcStatusHint: LOC_PROT_ERR "ACS is enabled ... GPU Direct RDMA"; RETRY_EXC_ERR a timeout
    assert WC_STATUS[4][1:] == ("config", "none", "check-config")
    assert WC_STATUS[12][1:] == ("unattributed", "none", "observe")
    assert WC_STATUS[9][1] == WC_STATUS[10][1] == "app"


@pytest.mark.parametrize("fmt", ["2.14", "2.27", "master"])
def test_unknown_wc_status_is_an_incident_not_known(fmt):
    root, _ = one([wc_line(fmt, 31, 5)])
    assert root.code == "ibv_wc:31" and root.known is False
    assert reading(root) == ("unattributed", "none", "observe")


def test_repeated_completions_with_timestamps_collapse():
    lines = [f"[2026-02-0{d} 11:{m:02d}:0{m % 10}] " + wc_line("2.27", 12, 3) for d, m in ((1, 10), (1, 11), (1, 12))]
    root, incs = one(lines)
    assert len(incs) == 1 and root.count == 3 and root.code == "ibv_wc:12" and root.device == "mlx5_3"


# -- async events -----------------------------------------------------------------------------

def async_line(fmt: str, num: int, dev: str = "mlx5_6", port: int = 1) -> str:
    text = EVENT_TEXTS[num]
    if fmt == "2.18":
        body = f"NET/IB : Got async event : {text}"
    elif fmt == "2.21":
        body = f"NET/IB : {dev}:{port} Got async event : {text}"
    elif fmt == "2.23":
        kind = FATAL_EVENTS.get(num, "-")
        if kind == "-":
            body = f"NET/IB : {dev}:{port} Got async error event: {text}"
        elif kind is None:
            body = f"NET/IB : {dev}:{port} async fatal event: {text}"
        elif kind == "SRQ":
            body = f"NET/IB : {dev}:{port} async fatal event on SRQ, unused for now (0x55d1c0a8f{num:03x}): {text}"
        else:
            body = f"NET/IB : {dev}:{port} async fatal event on {kind} (0x7f3a{num:04x}b0): {text}"
    else:  # master common.cc
        kind = FATAL_EVENTS.get(num, "-")
        if num == 18:
            body = f"NET/IB : {dev}:{port} GID table changed"
        elif kind == "QP":
            body = (f"NET/IB : {dev}:{port} async fatal event on QP (0x7f12{num:04x}) qpn={900 + num} handle=7 "
                    f"send_cq=3 recv_cq=4 state=6 sq_psn=1234 rq_psn=99: {text}")
        elif kind == "CQ":
            body = f"NET/IB : {dev}:{port} async fatal event on CQ (0x7f00aa) handle=2 cqe=4096: {text}"
        elif kind is None:
            body = f"NET/IB : {dev}:{port} async fatal event: {text}"
        elif kind == "SRQ":
            body = f"NET/IB : {dev}:{port} async fatal event on SRQ, unused for now (0x1): {text}"
        else:
            body = f"NET/IB : {dev}:{port} Got non-fatal async event: {text}({num})"
    return warn("dgx-b7", 41000 + num, 41200, 2, "transport/net_ib/common.cc:179", body)


# COMM_EST (4): NCCL prints nothing; master logs a speed change (20) as INFO in its own words
@pytest.mark.parametrize("fmt,num", [(f, n) for f in ("2.18", "2.21", "2.23", "master") for n in range(len(EVENT_TEXTS))
                                     if n != 4 and (f, n) != ("master", 20)])
def test_every_async_event_in_every_nccl_format(fmt, num):
    root, _ = one([async_line(fmt, num, dev=f"mlx5_{num % 4}", port=1 + num % 2)])
    expect = ASYNC_EVENTS[EVENT_TEXTS[num].lower()]
    assert root.code == f"ibv_event:{expect[0]}" and root.known
    assert reading(root) == expect[1:]
    assert root.device == (None if fmt == "2.18" else f"mlx5_{num % 4}/{1 + num % 2}")


def test_event_table_is_rdma_cores():
    from linkpass.core.evidence.rdma import ASYNC_EVENT_NUMBERS
    assert ASYNC_EVENT_NUMBERS == {n: t.lower() for n, t in enumerate(EVENT_TEXTS)}
    assert ASYNC_EVENTS["port error"][1:] == ("nic-link", "reroute", "observe")
    assert ASYNC_EVENTS["local catastrophic error"][1:] == ("nic-device", "reroute", "reboot-node")


def test_master_non_fatal_event_by_number_and_unknown_ones():
    root, _ = one([warn("h1", 7, 8, 0, "net_ib/common.cc:184", "NET/IB : mlx5_2:1 unknown event type (9)")])
    assert root.code == "ibv_event:port_active" and root.domain == "benign"   # 9 = IBV_EVENT_PORT_ACTIVE
    root, _ = one([warn("h1", 7, 8, 0, "net_ib/common.cc:184", "NET/IB : mlx5_2:1 unknown event type (57)")])
    assert root.code == "ibv_event:unknown_57" and root.known is False and root.device == "mlx5_2/1"
    root, _ = one([warn("h1", 7, 8, 0, "net_ib/common.cc:179",
                        "NET/IB : mlx5_11:2 Got non-fatal async event: quantum flux reversal(33)")])
    assert root.known is False and root.code == "ibv_event:other" and reading(root) == ("unattributed", "none", "observe")


def test_port_error_on_every_local_rank_is_one_incident():
    lines = [warn("node7", 500 + r, 600 + r, r, "transport/net_ib.cc:93", "NET/IB : Got async event : port error")
             for r in range(8)]
    root, incs = one(lines)
    assert len(incs) == 1 and root.code == "ibv_event:port_err" and root.count == 8


def test_device_fatal_then_async_thread_calls_failing_is_one_incident():
    lines = []
    for r in range(3):
        lines.append(f"2026-04-01T08:00:0{r}.120Z: [1,{r}]<stdout>:" +
                     warn("ctr-9", 900 + r, 950 + r, r, "transport/net_ib.cc:101",
                          "NET/IB : mlx5_4:1 async fatal event: local catastrophic error"))
        lines.append(f"2026-04-01T08:00:0{r}.121Z: [1,{r}]<stdout>:" +
                     warn("ctr-9", 900 + r, 950 + r, r, "misc/ibvwrap.cc:208", "Call to ibv_get_async_event failed"))
    root, incs = one(lines)
    assert len(incs) == 1 and root.code == "ibv_event:device_fatal" and root.device == "mlx5_4/1"
    assert reading(root) == ("nic-device", "reroute", "reboot-node")


def test_comm_fatal_follows_the_fatal_async_event_printed_after_it():
    lines = [warn("h100-3", 238, 1313, 0, "transport/net_ib/common.cc:32",
                  "communicator encountered a fatal error (detected in ncclIbTest)"),
             warn("h100-3", 238, 1219, 0, "transport/net_ib/common.cc:140",
                  "NET/IB : mlx5_7:1 async fatal event on QP (0x7f1) qpn=77 handle=1 send_cq=1 recv_cq=2 state=6 "
                  "sq_psn=1 rq_psn=2: local work queue catastrophic error")]
    root, incs = one(lines)
    assert root.code == "ibv_event:qp_fatal" and root.device == "mlx5_7/1"
    (sec,) = [i for i in incs if i.secondary_of is not None]
    assert sec.code == "nccl:comm_fatal" and sec.domain == "app" and sec.action == "none"


def test_comm_fatal_alone_is_unattributed():
    root, _ = one([warn("a", 1, 2, 3, "transport/net_ib.cc:139", "communicator encountered a fatal error (detected in ncclIbIsend)")])
    assert root.code == "nccl:comm_fatal" and reading(root) == ("unattributed", "none", "observe")


# -- verbs calls ------------------------------------------------------------------------------

@pytest.mark.parametrize("line,code,rd", [
    # master wrap_ibv_modify_qp: "Call to ibv_modify_qp failed with %d %s, %s" (+ ibvModifyQpLog)
    ("Call to ibv_modify_qp failed with 110 Connection timed out, on dev mlx5_5:1, curr state INIT, next state RTR, "
     "local GID index 3, local GID ::ffff:10.9.8.7, remote GID ::ffff:10.9.9.7",
     "nccl:modify_qp_timeout", ("config", "none", "check-config")),
    # older IBV_INT_CHECK_RET_ERRNO: "Call to %s failed with error %s errno %d"
    ("Call to ibv_modify_qp failed with error Connection timed out errno 110",
     "nccl:modify_qp_timeout", ("config", "none", "check-config")),
    ("Call to ibv_modify_qp failed with 22 Invalid argument, on dev mlx5_bond_0:1, curr state RTR, next state RTS, "
     "local GID index -1, local GID N/A, remote GID N/A", "nccl:modify_qp_invalid", ("config", "none", "check-config")),
    ("Call to ibv_modify_qp failed with error No such device errno 19",
     "nccl:ibv_modify_qp_failed", ("unattributed", "none", "observe")),
    ("Call to ibv_reg_mr failed with error Bad address", "nccl:reg_mr_failed", ("config", "none", "check-config")),
    ("Call to ibv_create_cq failed", "nccl:ibv_create_cq_failed", ("unattributed", "none", "observe")),
])
def test_failed_verbs_calls(line, code, rd):
    root, _ = one([f"[2026-05-0{len(line) % 9 + 1} 03:04:05] " + warn("hgx-12.example.net", 8181, 8282, 5, "misc/ibvwrap.cc:376", line)])
    assert root.code == code and reading(root) == rd and root.device is None and root.known


def test_unknown_verbs_call_is_known_false():
    root, _ = one([warn("n", 1, 1, 0, "misc/ibvwrap.cc:99", "Call to ibv_frobnicate_qp failed with error Input/output error errno 5")])
    assert root.code == "nccl:ibv_frobnicate_qp_failed" and root.known is False


# -- CUDA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("num,text,code", [
    (700, "an illegal memory access was encountered", "cuda:illegal_address"),
    (2, "out of memory", "cuda:out_of_memory"),
    (719, "unspecified launch failure", "cuda:launch_failure"),
    (710, "device-side assert triggered", "cuda:assert"),
    (716, "misaligned address", "cuda:misaligned_address"),
    (214, "uncorrectable ECC error encountered", "cuda:ecc_uncorrectable"),
    (220, "uncorrectable NVLink error detected during the execution", "cuda:nvlink_uncorrectable"),
    (35, "CUDA driver version is insufficient for CUDA runtime version", "cuda:insufficient_driver"),
    (999, "unknown error", "cuda:unknown"),
])
@pytest.mark.parametrize("fmt", ["cudawrap", "checks", "torch", "watchdog"])
def test_cuda_errors_in_nccl_and_torch_formats(num, text, code, fmt):
    if fmt == "cudawrap":      # cudawrap.h CUCHECK: "Cuda failure %d '%s'"
        line = warn("node-q", 7400 + num, 7642, 1, "include/alloc.h:125", f"Cuda failure {num} '{text}'")
    elif fmt == "checks":      # checks.h CUDACHECK: "Cuda failure '%s'"
        line = warn("node-q", 7401, 7643, 2, "enqueue.cc:1580", f"Cuda failure '{text}'")
    elif fmt == "torch":       # c10 C10_CUDA_CHECK
        line = f"RuntimeError: CUDA error: {text}\n"
    else:                      # ProcessGroupNCCL watchdog rethrowing it
        line = (f"[rank5]:[E1103 09:15:02.000123456 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 5] "
                f"Process group watchdog thread terminated with exception: CUDA error: {text}\n")
    root, incs = one([line])
    assert len(incs) == 1 and root.code == code and root.known
    assert reading(root) == CUDA_READINGS.get(num, ("app", "none", "none"))


def test_cuda_hardware_errors_read_as_hardware():
    assert CUDA_READINGS[214] == ("gpu-memory", "migrate-rank", "reset-gpu")
    assert CUDA_READINGS[220][0] == "nvlink"
    assert 700 not in CUDA_READINGS and 2 not in CUDA_READINGS and 719 not in CUDA_READINGS  # app faults


def test_torch_allocator_out_of_memory():
    line = ("[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 2 has a total "
            "capacity of 79.10 GiB of which 1.02 GiB is free.\n")
    root, _ = one([line])
    assert root.code == "cuda:out_of_memory" and reading(root) == ("app", "none", "none")


def test_unknown_cuda_error_is_known_false():
    root, _ = one([warn("z", 5, 6, 0, "misc/cudawrap.cc:88", "Cuda failure 1234 'something new'")])
    assert root.code == "cuda:1234" and root.known is False and root.domain == "app"
    root, _ = one([warn("z", 5, 6, 0, "proxy.cc:900", "Cuda failure 'a brand new failure'")])
    assert root.code == "cuda:other" and root.known is False


def test_launch_failure_after_a_lost_gpu_is_its_secondary():
    lines = ["[ 8812.441201] NVRM: Xid (PCI:0000:c3:00): 79, pid=7711, name=python3, GPU has fallen off the bus.\n",
             "[rank6]: RuntimeError: CUDA error: unspecified launch failure\n"]
    incs = classify(lines)
    assert [(i.code, i.secondary_of) for i in incs] == [("xid:79", None), ("cuda:launch_failure", 0)]
    assert incs[1].domain == "gpu" and incs[1].action == "none"


# -- a rank's CUDA fault explains its host's NCCL symptoms -------------------------------------

def test_oom_explains_same_host_socket_and_remote_error_interleaved():
    lines = [
        warn("nodeA", 2201, 2301, 0, "proxy.cc:1500", "Cuda failure 2 'out of memory'"),
        warn("nodeB", 3301, 3401, 1, "misc/socket.cc:50", "socketProgress: Connection closed by remote peer nodeB<41233>"),
        warn("nodeA", 2202, 2302, 1, "misc/socket.cc:50", "socketProgress: Connection closed by remote peer nodeA<50112>"),
        "[rank1]: torch.distributed.DistBackendError: NCCL error in: /src/torch/csrc/distributed/c10d/NCCLUtils.hpp:317,"
        " remote process exited or there was a network error, NCCL version 2.23.4\n",
        warn("nodeA", 2202, 2302, 1, "transport/net_socket.cc:540", "Net : Connection closed by remote peer nodeA<50113>"),
    ]
    incs = classify(lines)
    assert incs[0].code == "cuda:out_of_memory" and incs[0].secondary_of is None
    secs = {i.code for i in incs if i.secondary_of == 0}
    assert "nccl:socket_error" in secs
    assert all(i.action == "none" for i in incs)


def test_oom_on_another_host_does_not_explain_a_socket_error():
    lines = [warn("nodeA", 11, 12, 0, "proxy.cc:1", "Cuda failure 2 'out of memory'"),
             warn("nodeC", 21, 22, 3, "misc/socket.cc:50", "socketProgress: Connection closed by remote peer nodeD<1>")]
    incs = classify(lines)
    assert [(i.code, i.secondary_of) for i in incs] == [("cuda:out_of_memory", None), ("nccl:socket_error", None)]


def test_illegal_address_explains_watchdog_timeout_of_a_single_host_run():
    lines = ["[rank0]:[E ProcessGroupNCCL.cpp:1414] [PG 0 Rank 0] Process group watchdog thread terminated with "
             "exception: CUDA error: an illegal memory access was encountered\n",
             "[rank1]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught collective operation "
             "timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran "
             "for 600031 milliseconds before timing out.\n"]
    incs = classify(lines)
    assert [(i.code, i.secondary_of) for i in incs] == [("cuda:illegal_address", None), ("nccl:watchdog_timeout", 0)]


# -- PyTorch / NCCL result codes, watchdog, heartbeat, sockets ---------------------------------

@pytest.mark.parametrize("line,code,rd", [
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
     "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
     "nccl:system_error", ("unattributed", "none", "observe")),
    ("ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ",
     "nccl:system_error", ("unattributed", "none", "observe")),
    ("ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
     "nccl:remote_error", ("unattributed", "none", "observe")),
    ("NCCL error in: c10d/NCCLUtils.hpp:121, internal error - please report this issue to the NCCL developers, "
     "NCCL version 2.20.5", "nccl:internal_error", ("unattributed", "none", "observe")),
    ("ncclUnhandledCudaError: Call to CUDA function failed.", "nccl:cuda_error", ("unattributed", "none", "observe")),
    ("ncclInvalidUsage: This usually reflects invalid usage of NCCL library.", "nccl:invalid_usage", ("app", "none", "none")),
    ("NCCL error in: x.cpp:9, invalid argument (run with NCCL_DEBUG=WARN for details), NCCL version 2.26.2",
     "nccl:invalid_argument", ("app", "none", "none")),
    ("[Rank 12] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=_ALLGATHER_BASE, NumelIn=16, "
     "NumelOut=512, Timeout(ms)=1800000) ran for 1800410 milliseconds before timing out.",
     "nccl:watchdog_timeout", ("unattributed", "none", "observe")),
    ("[PG ID 0 PG GUID 0(default_pg) Rank 3] Heartbeat monitor timed out! Process will be terminated after dumping "
     "debug info. workMetaList_.size()=2", "nccl:heartbeat_timeout", ("unattributed", "none", "observe")),
    ("ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued "
     "collectives.", "nccl:heartbeat_timeout", ("unattributed", "none", "observe")),
    ("NCCL WARN ncclOsSocketProgressOpt: Call to recv from 10.4.4.4<60012> failed : Connection reset by peer",
     "nccl:socket_error", ("unattributed", "none", "observe")),
    ("NCCL WARN socketStartConnect: Connect to 172.16.1.9<44321> failed : No route to host",
     "nccl:socket_error", ("unattributed", "none", "observe")),
    ("NCCL WARN bootstrapRoot: connect to 172.16.1.9<44321> returned Connection refused, exceeded error retry count "
     "after 35 attempts", "nccl:socket_error", ("unattributed", "none", "observe")),
    ("NCCL WARN socketPollConnect: exceeded timeouts (20)", "nccl:socket_error", ("unattributed", "none", "observe")),
])
def test_nccl_and_torch_texts(line, code, rd):
    root, _ = one([f"[rank{len(line) % 8}]:[E{len(line) % 12 + 1:02d}01 10:00:00.0 x.cpp:1] " + line + "\n"])
    assert root.code == code and reading(root) == rd and root.known


def test_unknown_nccl_result_is_known_false():
    root, _ = one(["NCCL error in: a.cpp:1, unknown result code, NCCL version 2.99.1\n"])
    assert root.code == "nccl:unknown_result" and root.known is False
    root, _ = one(["ncclQuantumError: the future is here\n"])
    assert root.code == "nccl:unknown_result" and root.known is False


def test_watchdog_on_every_rank_is_one_incident():
    lines = [f"[rank{r}]:[E1218 20:27:2{r}.4 ProcessGroupNCCL.cpp:629] [Rank {r}] Watchdog caught collective operation "
             f"timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for "
             f"60008{r} milliseconds before timing out.\n" for r in range(4)]
    root, incs = one(lines)
    assert len(incs) == 1 and root.count == 4


# -- robustness -------------------------------------------------------------------------------

SAMPLES = [wc_line("master", 12, 4), wc_line("2.14", 5, 9), async_line("master", 10), async_line("2.23", 3),
           warn("h", 1, 2, 3, "misc/ibvwrap.cc:376", "Call to ibv_modify_qp failed with 110 Connection timed out, on dev mlx5_1:1"),
           warn("h", 1, 2, 3, "include/alloc.h:125", "Cuda failure 700 'an illegal memory access was encountered'"),
           "[rank0]: Process group watchdog thread terminated with exception: CUDA error: out of memory\n",
           "torch.distributed.DistBackendError: NCCL error in: a.hpp:1, unhandled system error (run with NCCL_DEBUG=INFO\n"]


@pytest.mark.parametrize("k", range(len(SAMPLES)))
def test_cut_off_lines_never_raise(k):
    line = SAMPLES[k].rstrip("\n")
    for cut in range(1, len(line), 3):
        rep = classify_report([SAMPLES[(k + 1) % len(SAMPLES)], line[:cut]])
        assert rep.error is None
        classify_text(SAMPLES[k] + line[:cut])


def test_malformed_lines_give_no_traceback():
    junk = ["NET/IB : Got completion from peer  with status=", "Cuda failure  ''", "Call to ibv_ failed with",
            "NET/IB : :1 unknown event type ()", "NET/IB : mlx5_0:x Got non-fatal async event: (", "\x00\xff Cuda failure 7",
            "CUDA error: ", "ncclError", "Watchdog caught collective operation timeout"]
    rep = classify_report([j + "\n" for j in junk])
    assert rep.error is None


@pytest.mark.parametrize("body,code,known", [
    ("[Proxy Service 3] Failed to execute operation Connect from rank 3, retcode 6", "nccl:remote_error", True),
    ("[Proxy Service 14] Failed to execute operation Setup from rank 14, retcode 2", "nccl:system_error", True),
    ("[Service thread] Error encountered progressing operation=Connect, res=3, closing connection",
     "nccl:internal_error", True),
    ("[Service thread] Error encountered progressing operation=Register, res=42, closing connection",
     "nccl:unknown_result", False),
])
def test_proxy_errors_carry_an_nccl_result(body, code, known):
    root, _ = one([warn("p5-node-4", 61000, 61001, 6, "proxy.cc:1861", body)])
    assert root.code == code and root.known is known and root.action == "none"


def test_cuda_text_followed_by_torch_advice_on_the_same_line():
    root, _ = one(["RuntimeError: CUDA error: misaligned address Compile with `TORCH_USE_CUDA_DSA` to enable "
                   "device-side assertions.\n"])
    assert root.code == "cuda:misaligned_address" and root.known


def test_nccl_unhandled_cuda_error_follows_the_cuda_failure_it_reports():
    lines = [warn("gx-1", 4100, 4101, 3, "enqueue.cc:1551", "Cuda failure 'out of memory'"),
             "torch.distributed.DistBackendError: NCCL error in: c10d/ProcessGroupNCCL.cpp:2006, unhandled cuda error "
             "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n",
             "ncclUnhandledCudaError: Call to CUDA function failed.\n"]
    incs = classify(lines)
    assert [(i.code, i.domain, i.secondary_of) for i in incs] == [("cuda:out_of_memory", "app", None),
                                                                  ("nccl:cuda_error", "app", 0)]


def test_a_status_number_cut_off_is_not_read_as_a_shorter_one():
    line = wc_line("2.27", 12, 2)
    cut = line[:line.index("status=12") + len("status=1")]
    assert [i.code for i in classify_text(cut)] == []
    assert [i.code for i in classify_text(line)] == ["ibv_wc:12"]
