"""``python -m devenv.deploy --image TAG``: the deployment test (:mod:`devenv.deploy.scenario`)."""

import sys

from devenv.deploy.scenario import main

sys.exit(main())
