"""Faults under mixed traffic (recovery, clean outcomes, leaks) and the router's RSS drift."""
