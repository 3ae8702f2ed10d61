// Package interop holds tests of the library with third-party clients that
// the library itself must not depend on, such as
// github.com/hashicorp/go-retryablehttp.
//
// They live in the lab's module, not the library's, because a test of an
// imported package counts for its importer's go mod tidy: a test in
// idemhttp that imported go-retryablehttp would add it to the go.sum of
// every application that imports idemhttp. The lab's module is already
// where the library's heavier tools live. The package has no code of its
// own.
package interop
