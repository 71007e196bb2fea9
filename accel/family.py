"""The accel backend's part of each model family (refimpl.family), keyed by `Family.name`: its engine."""
from __future__ import annotations

from accel.engine import AccelEngine
from accel.vision.engine import VisionAccelEngine
from refimpl.family import TEXT, VISION

ENGINES = {TEXT.name: AccelEngine, VISION.name: VisionAccelEngine}
