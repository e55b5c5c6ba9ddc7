import sys

from benchmarks.chaos_soak.soak import main

sys.exit(main())
