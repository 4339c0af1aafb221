"""The Kineto trace format: its vocabulary (categories, flows, collective and kernel names)."""
