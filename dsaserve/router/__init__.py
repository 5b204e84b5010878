"""The prefix- and load-aware router: `dsaserve router` in front of several `dsaserve serve`s."""
