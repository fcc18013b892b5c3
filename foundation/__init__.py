"""What every layer shares, at the bottom of the layering (agent, rewards, data, models -> inference -> backends ->
experiments -> analysis all may import it; it imports none of them): config errors and the run directory."""
