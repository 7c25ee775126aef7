"""Read TensorBoard event files back without TensorFlow: a TFRecord reader and tensorboardX's protobufs."""

from __future__ import annotations

import glob
import os
import struct

from tensorboardX.proto import event_pb2


def event_files(workdir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*")))


def read_event_file(path: str) -> list[event_pb2.Event]:
  """The events of one file, in order (TFRecord: 8-byte length, 4-byte CRC, payload, 4-byte CRC)."""
  with open(path, "rb") as f:
    data = f.read()
  events, pos = [], 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos : pos + 8])
    events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
    pos += 12 + length + 4
  return events


def read_events(workdir: str) -> list[event_pb2.Event]:
  """Every event of every event file in ``workdir``, file by file."""
  return [event for path in event_files(workdir) for event in read_event_file(path)]


def scalars_by_step(events) -> dict[int, dict[str, float]]:
  out: dict[int, dict[str, float]] = {}
  for event in events:
    for value in event.summary.value:
      if value.HasField("simple_value"):
        out.setdefault(event.step, {})[value.tag] = value.simple_value
  return out


def purge_steps(events) -> list[int]:
  """Steps of the session-start events a writer with ``purge_step`` leaves (TensorBoard drops later steps)."""
  return [
    e.step
    for e in events
    if e.HasField("session_log") and e.session_log.status == e.session_log.START
  ]
