import sys

from pd_sessions.cli import main

sys.exit(main())
