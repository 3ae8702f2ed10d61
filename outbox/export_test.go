package outbox

import "time"

// SetIntervals shortens a relay's background intervals for tests: how
// often it purges and counts its backlog, how long it waits for its probe
// notification, and how long before it probes again.
func SetIntervals(r *Relay, maintain, probeWait, reprobe time.Duration) {
	r.purgeEvery, r.probeWait, r.reprobeEvery = maintain, probeWait, reprobe
}
