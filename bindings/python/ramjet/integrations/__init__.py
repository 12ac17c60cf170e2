"""Integrations of ramjet with training frameworks. Each is imported on its own, lazily, so
``import ramjet`` never imports a framework:

- :mod:`ramjet.integrations.ultralytics`: YOLO training streamed from object storage
  (``pip install 'ramjet[ultralytics]'``).
"""
