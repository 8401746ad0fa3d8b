"""The local stack: control plane, process node, demo. Development only, never in an image."""
