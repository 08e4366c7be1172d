"""`tengyun bench serve` (HTTP load test) and `tengyun bench throughput` (offline)."""
