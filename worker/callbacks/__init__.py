"""Signed callbacks: POST each finished job's result to its `callbackUrl` (see sender.py)."""

from worker.callbacks.sender import CallbackSender, callback_sender

__all__ = ["CallbackSender", "callback_sender"]
