"""The engine: its loop, scheduler, step programs, placements (one device, a mesh) and executable cache."""
