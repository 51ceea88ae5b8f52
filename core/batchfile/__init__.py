"""The batch file format: input lines, request bodies, result lines."""
