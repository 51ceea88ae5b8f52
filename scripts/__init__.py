"""Service benchmarks and developer scripts (run as ``python scripts/<name>.py``; the tests
import the fairness benchmark's scenarios from here)."""
