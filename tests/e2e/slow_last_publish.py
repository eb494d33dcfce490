"""`dflash` (cli.main) with rank 1's last publish held back 3 s: test_store_pipeline's two-node extraction runs
through it, so rank 0 finishes first every time and must keep the job's lease until rank 1 has published (it
released it on return, and rank 1's last commit then found the lease gone: one CI run failed so)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: cli and dflash

from dflash.store import sync  # noqa: E402

if os.environ.get("RANK") == "1":
    finish = sync.Publisher.finish

    def held_back(self, *args, **kwargs):
        time.sleep(3)
        return finish(self, *args, **kwargs)

    sync.Publisher.finish = held_back

from cli.main import main  # noqa: E402

sys.exit(main())
