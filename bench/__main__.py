"""``python -m bench``: run the benchmarks and write bench/results/report.{md,json}."""
import sys

from bench.run import main

sys.exit(main())
