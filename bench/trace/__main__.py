import sys

from bench.trace import main

sys.exit(main())
