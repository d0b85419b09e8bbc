# SPDX-License-Identifier: LGPL-2.1-or-later
"""Encoder / Prefill / Decode worker harness around a Hugging Face Qwen3-VL model.

The model side (qwen3vl.py) is independent of how state moves: the workers hand
features and KV through small sink/source interfaces, which the epd connectors
(connector.py) implement over epdd and which tests implement in memory."""
