"""Worker: claims jobs from Redis, parks them until start, runs them under nsjail."""
