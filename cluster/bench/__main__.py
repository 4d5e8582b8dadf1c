import sys

from cluster.bench.runner import main

sys.exit(main())
