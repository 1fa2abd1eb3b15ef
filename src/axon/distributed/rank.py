"""`python -m axon.distributed.rank TARGET --rank R ...`: one tensor-parallel rank's program
(see rank_process). Only this guard runs here, so that the rank imports rank_process once,
under its own name."""

from axon.distributed.rank_process import run_rank

if __name__ == "__main__":
    raise SystemExit(run_rank())
