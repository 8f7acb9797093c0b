"""What tests and benchmarks start for real: a local valkey-server and a Valkey Cluster (valkey.py)."""
