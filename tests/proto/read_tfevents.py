#!/usr/bin/env python3
"""An event file reader written from TensorBoard's format, independent of
Estuary's writer (proto/event_file.cc) and of any protobuf library: TFRecord
framing with both CRC32C checks (computed bit by bit from the Castagnoli
polynomial), then the Event and Summary messages decoded from the protobuf
wire format by hand. Prints the file as JSON:
  {"file_version": "...", "events": [{"step": S, "wall_time": T, "scalars": {tag: value}}]}
Exits non-zero, naming the record, on a bad length, a bad CRC or a field it
does not expect.
  read_tfevents.py FILE
"""
import json
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, at):
    value, shift = 0, 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(buf):
    """(field number, wire type, value) of each field of a message."""
    at = 0
    while at < len(buf):
        key, at = varint(buf, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = varint(buf, at)
        elif wire == 1:
            value, at = buf[at:at + 8], at + 8
        elif wire == 2:
            length, at = varint(buf, at)
            value, at = buf[at:at + length], at + length
        elif wire == 5:
            value, at = buf[at:at + 4], at + 4
        else:
            raise ValueError(f"wire type {wire} of field {number}")
        yield number, wire, value


def scalars(summary):
    out = {}
    for number, wire, value in fields(summary):
        if number != 1 or wire != 2:
            raise ValueError(f"Summary field {number}")
        tag, simple = None, None
        for n, w, v in fields(value):
            if n == 1 and w == 2:
                tag = v.decode("utf-8")
            elif n == 2 and w == 5:
                simple = struct.unpack("<f", v)[0]
            else:
                raise ValueError(f"Summary.Value field {n}")
        out[tag] = simple
    return out


def main(path):
    data = open(path, "rb").read()
    at, index, result = 0, 0, {"file_version": None, "events": []}
    while at < len(data):
        if len(data) - at < 12:
            sys.exit(f"{path}: record {index}: {len(data) - at} bytes left, a header needs 12")
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        if masked(header) != length_crc:
            sys.exit(f"{path}: record {index}: the length's CRC does not match")
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if len(body) != length or masked(body) != body_crc:
            sys.exit(f"{path}: record {index}: the data's CRC does not match")
        event = {"step": 0, "wall_time": None, "scalars": None}
        for number, wire, value in fields(body):
            if number == 1 and wire == 1:
                event["wall_time"] = struct.unpack("<d", value)[0]
            elif number == 2 and wire == 0:
                event["step"] = value
            elif number == 3 and wire == 2:
                result["file_version"] = value.decode("utf-8")
            elif number == 5 and wire == 2:
                event["scalars"] = scalars(value)
            else:
                sys.exit(f"{path}: record {index}: Event field {number}")
        if event["scalars"] is not None:
            result["events"].append(event)
        at += 16 + length
        index += 1
    print(json.dumps(result))


if __name__ == "__main__":
    if crc32c(b"123456789") != 0xE3069283:  # CRC-32C's check value
        sys.exit("read_tfevents.py: the CRC32C here is wrong")
    main(sys.argv[1])
