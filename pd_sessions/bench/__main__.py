import sys

from pd_sessions.bench.cli import main

sys.exit(main())
