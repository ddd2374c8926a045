"""``python -m moe_comm.bench NAME [options]``: see ``moe_comm.bench``."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
