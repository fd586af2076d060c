"""Shared by every test folder: the repository root (tests are collected as the package `tests`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
