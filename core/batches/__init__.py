"""What a batch is, whatever stores it: the ids it and its lines are given, its priority and
completion window, how its file is cut into shards, and which of its lines a retry takes."""
