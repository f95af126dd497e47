"""What a run achieves while it trains: samples/s, TFLOP/s, MFU and peak memory (:class:`VitScaleThroughput`).

A Lightning callback; of the other concerns it imports only the device table (``memory/devices.py``: the peaks
MFU divides by).
"""

from lightning_vitscale.monitoring.throughput import VitScaleThroughput

__all__ = ["VitScaleThroughput"]
