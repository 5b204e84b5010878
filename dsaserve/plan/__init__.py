"""Cost model and capacity planner (`dsaserve plan`): hardware presets, pure cost functions, CLI."""
