"""The step runtime shared by the engine, the drafters, speculation, tensor parallelism and training:
the model runner, logits processing and sampling, emission with finish scans, failure isolation.
NOTE: it imports only models/, cache/, grammar/ and core; everything above imports it, never the reverse."""
