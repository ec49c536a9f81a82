"""The tensor-moving interface: `Comm` carries tensors between workers and counts every byte."""

from fast.comm.accounting import ByteCounter
from fast.comm.comm import Comm, Handle, MessageLost

__all__ = ["ByteCounter", "Comm", "Handle", "MessageLost"]
