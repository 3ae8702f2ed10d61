// Package keylock holds the id of the transaction-scoped advisory lock
// that a call holds on its key, and the tag that marks idem's lock ids.
package keylock

// Tag fills the top 16 bits of every key's lock id, so that idem's
// advisory locks can be told from an application's in pg_locks, where the
// top half of a bigint lock id is classid: classid >> 16 is Tag.
//
// idem's lock ids are thus the bigints 0x1de0000000000000 to
// 0x1de0ffffffffffff (2152720621883097088 to 2153002096859807743), which
// pg_locks shows as locktype advisory, objsubid 1, classid 501219328 to
// 501284863. Nothing else tells idem's locks from others: idem stats, idem
// inspect and idem_key_lock count every bigint advisory lock of this
// database in that range as idem's, an application's own included. An
// application that takes advisory locks by bigint id should keep its ids out
// of the range; ids spread over all bigints, as hashtextextended's are, land
// in it once in 65,536. Locks taken with two int keys (objsubid 2) are
// never counted.
const Tag = 0x1de0

// ID is the id of the transaction-scoped advisory lock that a call
// holds on (scope, key) from its claim until its transaction ends. pg_locks
// shows it as locktype advisory, objsubid 1, classid its top 32 bits and
// objid its bottom 32. Below Tag, it is a 48-bit FNV-1a hash of scope
// and key: two keys with the same hash only wait for each other, and the
// primary key, not the lock, keeps their records apart. See [Tag] for the
// range of ids this gives, and what else may hold one.
func ID(scope, key string) int64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := range len(scope) {
		h = (h ^ uint64(scope[i])) * prime
	}
	h *= prime // a NUL byte between them: no identifier holds one
	for i := range len(key) {
		h = (h ^ uint64(key[i])) * prime
	}
	return Tag<<48 | int64(h&(1<<48-1))
}

// FlowTag fills the top 16 bits of a flow's lock id, apart from the keys'
// (Tag), so that idem stats and idem_key_lock, which count the keys' locks
// in flight, do not count flows, and a flow and a key of the same scope
// and key do not wait for each other.
const FlowTag = 0x1de1

// FlowID is the id of the transaction-scoped advisory lock that the
// transaction writing a new flow's row for (scope, key) holds until it
// ends (see idem.Flow): ID's hash of scope and key, under FlowTag.
func FlowID(scope, key string) int64 {
	return FlowTag<<48 | ID(scope, key)&(1<<48-1)
}
