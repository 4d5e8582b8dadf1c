import sys

from cluster.bench.commands import main

sys.exit(main())
