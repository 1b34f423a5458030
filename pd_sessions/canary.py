"""``python -m pd_sessions.canary mooncake [nixl]``: the import canary under the name the docs
(docs/how-to/installed-vllm.md) give; the canary itself is ``pd_sessions.env.import_canary``.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. It imports the connectors
inside the interpreter under test, in a process of its own, so a native crash ends it alone.
"""

import sys

from pd_sessions.env.import_canary import main

if __name__ == "__main__":
    sys.exit(main())
