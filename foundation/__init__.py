"""What every layer shares, at the bottom of the layering (agent, rewards, data, models -> inference -> backends ->
jobs -> analysis all may import it; it imports none of them): config errors and the run directory."""
