"""``python -m moe_comm.accuracy``: the accuracy table of ``suite.main`` and its exit status."""
from .suite import main

if __name__ == "__main__":
    raise SystemExit(main())
