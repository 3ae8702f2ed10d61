// Command grpc is the release rehearsal's gRPC application (.ci/release),
// built in a module of its own against a release of idemgrpc, as an
// application takes it. It serves a unary method through idemgrpc's server
// interceptor on 127.0.0.1, calls it twice with one key through the
// client interceptor's metadata, and checks that the second call is
// answered from the record, the handler having run once.
package main

import (
	"context"
	"fmt"
	"log"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
)

const method = "/rehearsal.Payments/Charge"

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	err = idem.Migrate(ctx, db)
	db.Close()
	if err != nil {
		log.Fatal(err)
	}
	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{
		Scope:    func(context.Context) (string, error) { return "rehearsal-grpc", nil },
		Required: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	var handled atomic.Int64
	srv := grpc.NewServer(grpc.UnaryInterceptor(interceptor))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "rehearsal.Payments",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Charge", Handler: func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			handler := func(ctx context.Context, req any) (any, error) {
				n := handled.Add(1)
				var id int64
				if err := idemgrpc.Tx(ctx).QueryRow(ctx, `SELECT $1::bigint`, n).Scan(&id); err != nil {
					return nil, err
				}
				return wrapperspb.String(fmt.Sprintf("charged %s, operation %d", req.(*wrapperspb.StringValue).GetValue(), id)), nil
			}
			return ic(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: method}, handler)
		}}},
	}, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	keyed := metadata.AppendToOutgoingContext(ctx, idemgrpc.DefaultMetadata, fmt.Sprintf("charge-%d", time.Now().UnixNano()))
	var answers []string
	for i := range 2 {
		out := new(wrapperspb.StringValue)
		var header metadata.MD
		if err := conn.Invoke(keyed, method, wrapperspb.String("2500"), out, grpc.Header(&header)); err != nil {
			log.Fatalf("call %d: %v", i+1, err)
		}
		replayed := len(header.Get(idemgrpc.ReplayedMetadata)) > 0
		if replayed != (i == 1) {
			log.Fatalf("call %d: replayed %t", i+1, replayed)
		}
		answers = append(answers, out.GetValue())
		fmt.Printf("grpc: call %d: %q, replayed %t\n", i+1, out.GetValue(), replayed)
	}
	if answers[0] != answers[1] || handled.Load() != 1 {
		log.Fatalf("answers %q, handler ran %d times; want one answer, once", answers, handled.Load())
	}
	fmt.Println("OK")
}
