"""The 0.5.16 pin's CPU tests run in their own Python (sglang 0.5.16 cannot share a process with
the 0.5.13.post1 tests): test_v2_pin.py builds the pin, lays it over a copy of the real 0.5.16
site and runs inner/ there. inner/ is collected only in that child run."""

import os

collect_ignore = [] if os.environ.get("DDTREE_V2_INNER") else ["inner"]
