#!/usr/bin/env python3
"""A foreign AMQP client (pika) for keyorder's interop tests.

  produce <amqp-url> <exchange> <rounds> <key>...
      one persistent message per key and round to <exchange> with routing key
      <key> and no other property, body "<key>/<round>", with confirms
  produce-hex <amqp-url> <exchange> <rounds> <key-hex>...
      the same with the routing key's raw bytes (which need not be UTF-8),
      body "<key-hex>/<round>"
  drop-unreadable <amqp-url> <queue>...
      removes from each queue the messages whose routing key is no UTF-8
      (acknowledged); the others go back to the queue, in order; prints how
      many it removed
  consume <amqp-url> <queue> <count>
      reads <count> messages from <queue> (acknowledging them) and prints one
      JSON line each: routing key, the keyorder-key header, body
"""
import json
import sys

import pika


def produce(url, exchange, rounds, keys, raw=False):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for r in range(rounds):
        for k in keys:
            # pika sends bytes as they are: a routing key need not be UTF-8.
            rk = bytes.fromhex(k) if raw else k
            ch.basic_publish(exchange=exchange, routing_key=rk, body=f"{k}/{r}".encode(),
                             properties=pika.BasicProperties(delivery_mode=2), mandatory=True)
    conn.close()


def drop_unreadable(url, queues):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    dropped = 0
    for queue in queues:
        ch = conn.channel()
        while True:
            method, _props, _body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            # pika hands over a short string that is no UTF-8 as bytes.
            if isinstance(method.routing_key, bytes):
                ch.basic_ack(method.delivery_tag)
                dropped += 1
        # Closing the channel returns every other message to the queue.
        ch.close()
    conn.close()
    print(dropped)


def consume(url, queue, count):
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    seen = 0
    for method, props, body in ch.consume(queue, inactivity_timeout=60):
        if method is None:
            break
        headers = props.headers or {}
        key = headers.get("keyorder-key")
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        print(json.dumps({"routing_key": method.routing_key, "key": key,
                          "body": body.decode("utf-8", "replace")}), flush=True)
        ch.basic_ack(method.delivery_tag)
        seen += 1
        if seen >= count:
            break
    ch.cancel()
    conn.close()
    if seen < count:
        sys.exit(f"read {seen} of {count} messages")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "produce":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    elif mode == "produce-hex":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:], raw=True)
    elif mode == "drop-unreadable":
        drop_unreadable(sys.argv[2], sys.argv[3:])
    elif mode == "consume":
        consume(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {mode}")
