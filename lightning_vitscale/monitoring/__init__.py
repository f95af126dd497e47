"""What a run achieves while it trains: samples/s, TFLOP/s, MFU and peak memory (:class:`VitScaleThroughput`).

A Lightning callback that imports no other concern.
"""

from lightning_vitscale.monitoring.throughput import VitScaleThroughput

__all__ = ["VitScaleThroughput"]
