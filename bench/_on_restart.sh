# torchrun --no-python entry of bench/snapshot.py's restart part:  sh bench/_on_restart.sh python SCRIPT ARGS
# Each attempt of torchrun's worker group (TORCHELASTIC_RESTART_COUNT n) gets its own hook report,
# progress file and store prefix (LINKPASS_JOB), and every attempt after the first resumes from the
# newest complete snapshot in $BENCH_SNAPSHOT_ROOT (LINKPASS_RESUME: the hook resolves a snapshots
# directory to its newest complete snapshot).  The first attempt must not get LINKPASS_RESUME: the
# directory holds no snapshot yet and the hook refuses to resume from nothing.
n="${TORCHELASTIC_RESTART_COUNT:-0}"
export LINKPASS_REPORT="$BENCH_RUN_DIR/a$n-r{rank}.json"
export LINKPASS_PROGRESS="$BENCH_RUN_DIR/a$n-p{rank}"
export LINKPASS_JOB="$BENCH_JOB-a$n"
if [ "$n" != 0 ]; then export LINKPASS_RESUME="$BENCH_SNAPSHOT_ROOT"; fi
exec "$@"
