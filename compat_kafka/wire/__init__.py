"""The Kafka wire: framing and request/response codec (kio), typed errors and the Kafka-code table,
checks of produced RecordBatches. Imports nothing else of the listener."""
