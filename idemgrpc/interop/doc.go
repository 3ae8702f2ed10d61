// Package interop holds the tests of idemgrpc and idemhttp with the
// libraries they are used with: go-grpc-middleware's retry interceptor, a
// retry storm through a proxy that cuts connections, and connect-go's
// clients and handlers through idemhttp. It has no code of its own.
//
// Those libraries are dependencies of these tests alone. Kept out of the
// package idemgrpc, whose tests a user's go mod tidy resolves, they are
// not downloaded by an application that imports idemgrpc.
package interop
