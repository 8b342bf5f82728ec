"""lance-sink, the storage side: WAL, memtables, shard writers, backpressure, flush, replay
and reads. Never imports Kafka or `sink`."""
