package idem

// RouteStoreOnCitus sets whether a record is stored on Citus by the
// statements Citus routes to one node (queueRouted), for BenchmarkCitusRun's
// comparison with PostgreSQL's statements, and returns the function that
// puts it back.
func RouteStoreOnCitus(on bool) (restore func()) {
	was := storeRoutedOnCitus
	storeRoutedOnCitus = on
	return func() { storeRoutedOnCitus = was }
}

// TxOver is txOver, for TestAnEmptyBatchBeginsNoTransaction.
var TxOver = txOver
