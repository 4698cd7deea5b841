"""Layer 4, engine: `Group` (engine/group.py) over an Arena, the algorithms and a P2PEngine; its
argument helpers, the warm-up a group starts at creation, and the phases of a creation."""
