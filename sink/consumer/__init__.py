"""The consumer loop's parts, around one partition state machine.

`sink.service.SinkService` wires them and runs the loop; each part owns one concern and
calls the others only through what they publish:

- `partition`: `PartitionState`, its `Phase`s and one function per transition;
- `flow`: the only code that pauses, resumes, seeks, assigns or unassigns;
- `lifecycle`: assign, open, recover, revoke, lost, release;
- `pipeline`: park -> decode -> hold -> put -> advance;
- `commits`: `done` offsets to the group, records without data skipped;
- `out_of_range`: fetch offsets the broker refused;
- `status`: the snapshots the loop publishes for metrics, readiness and status;
- `lease`: the loop's consume() calls and the status's passes over the consumer take turns;
- `broker_stats`: what librdkafka's statistics say; `conf`: the consumer's properties.
"""
