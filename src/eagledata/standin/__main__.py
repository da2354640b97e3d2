"""``python -m eagledata.standin``: the stand-in server's command line (:mod:`eagledata.standin.cli`)."""

import sys

from eagledata.standin.cli import main

sys.exit(main())
