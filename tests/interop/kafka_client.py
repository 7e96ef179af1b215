#!/usr/bin/env python3
"""A foreign Kafka client (kafka-python) for keyorder's interop tests.

  produce <brokers> <topic> <rounds> <key-hex>...
      one message per key and round, value "<key-hex>/<round>", keyed by the
      raw key bytes, on kafka-python's default partitioner (Java's murmur2)
  produce-crc32 <brokers> <topic> <rounds> <key-hex>...
      the same on a partitioner like librdkafka's default (consistent:
      CRC32 of the key), which puts most keys on other partitions
  consume <brokers> <topic> <count>
      reads <count> messages from the beginning of every partition and prints
      one JSON line each: partition, key (hex), value, and the partition
      Java's default partitioner gives the key
"""
import json
import sys
import zlib

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.partitioner.default import murmur2


def java_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def produce(brokers, topic, rounds, keys, crc32=False):
    producer = KafkaProducer(bootstrap_servers=brokers, acks="all", linger_ms=0)
    count = len(producer.partitions_for(topic))
    for r in range(rounds):
        for k in keys:
            key = bytes.fromhex(k)
            # CRC32 of the key, as librdkafka's default partitioner does.
            partition = zlib.crc32(key) % count if crc32 else None
            producer.send(topic, key=key, value=f"{k}/{r}".encode(), partition=partition).get(timeout=30)
    producer.flush()
    producer.close()


def consume(brokers, topic, count):
    consumer = KafkaConsumer(bootstrap_servers=brokers, enable_auto_commit=False,
                             consumer_timeout_ms=60000)
    parts = sorted(consumer.partitions_for_topic(topic) or [])
    consumer.assign([TopicPartition(topic, p) for p in parts])
    consumer.seek_to_beginning()
    seen = 0
    for m in consumer:
        key = m.key or b""
        print(json.dumps({"partition": m.partition, "key": key.hex(),
                          "value": m.value.decode("utf-8", "replace"),
                          "java_partition": java_partition(key, len(parts))}), flush=True)
        seen += 1
        if seen >= count:
            break
    consumer.close()
    if seen < count:
        sys.exit(f"read {seen} of {count} messages")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "produce":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    elif mode == "produce-crc32":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:], crc32=True)
    elif mode == "consume":
        consume(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {mode}")
