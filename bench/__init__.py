"""NCTV benchmarks (not tests): speed and cost figures measured side by side in one run."""
