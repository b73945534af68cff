"""Scaling out past one engine: a fleet of replicas behind Ray Serve's router and autoscaler
(ray_fleet.py), and a discrete-event simulator of the same fleet (simulate.py)."""
